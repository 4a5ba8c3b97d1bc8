"""The command-line roof: one ``echorl`` console entry (``main.py``), a subcommand per role."""
