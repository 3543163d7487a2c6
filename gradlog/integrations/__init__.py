"""Recording inside other trainers, each an optional extra: ``gradlog.integrations.
transformers`` (``pip install -e '.[hf]'``) and ``gradlog.integrations.lightning``
(``pip install -e '.[lightning]'``). Import the submodule you need; this package imports
neither."""
