"""The `python -m moetplan.cli` entry point."""
from moetplan.cli import main

main()
