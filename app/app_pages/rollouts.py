"""Rollouts: every completion of every step of the run (placeholder until the page lands)."""

import streamlit as st

st.title("Rollouts")
st.info("Rollouts: coming")
