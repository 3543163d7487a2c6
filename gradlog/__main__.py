"""``python -m gradlog``: the same as the ``gradlog`` command."""

from gradlog.cli.main import main

main()
