"""Building blocks of the web UI: pure figure and table builders (tested directly) and the cached
loaders and sidebar the pages share."""
