"""`python -m lockgate ...` is the `lockgate` command."""

from lockgate.gateway.cli import app

if __name__ == "__main__":
    app(prog_name="lockgate")
