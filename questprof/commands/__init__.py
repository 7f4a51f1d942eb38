"""One module per questprof command; cli.py is a thin Typer shell over them."""
