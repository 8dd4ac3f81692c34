"""`python -m sparrow.cli`."""

from sparrow.cli import app

app()
