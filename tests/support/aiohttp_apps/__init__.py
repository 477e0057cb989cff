"""aiohttp applications for graceful-drain's integration tests."""
