"""Recording inside other trainers, each an optional extra: ``gradlog.integrations.
transformers`` (``pip install 'gradlog[hf]'``) and ``gradlog.integrations.lightning``
(``pip install 'gradlog[lightning]'``). Import the submodule you need; this package imports
neither."""
