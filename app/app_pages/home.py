"""The app's root URL (``/``): opens the Tokens page (``/tokens``) with the URL's parameters."""

import streamlit as st

from app.components.navigation import DEFAULT_PAGE

st.switch_page(DEFAULT_PAGE, query_params=st.query_params.to_dict())
