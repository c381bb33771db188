"""Command-line tools; a package so that tests can import their logic."""
