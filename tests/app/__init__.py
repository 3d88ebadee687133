"""The Streamlit app: AppTest pages and real-browser tests (tests.fixtures.browser)."""
