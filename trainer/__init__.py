"""The training subprocess: `python -m trainer JOB.json`. The only jetlora package that imports torch."""

__version__ = "0.1.0"
