"""Demo assets for gradlog: a small character-level GPT and a bundled text corpus.

The corpus (Shakespeare's Sonnets, public domain) ships inside the package so that
demos and tests can train a real model without any network access.
"""

from gradlog.demo.data import CharCorpus, load_corpus
from gradlog.demo.model import CharGPT, GPTConfig

__all__ = ["CharCorpus", "CharGPT", "GPTConfig", "load_corpus"]
