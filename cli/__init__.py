"""The ``gradlog`` command line (typer + rich); ships as ``gradlog.cli``. Calls gradlog only."""
