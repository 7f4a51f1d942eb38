from questprof.cli import app

app(prog_name="questprof")
