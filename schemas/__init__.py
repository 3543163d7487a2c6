"""Normative specification of the gradlog store format, shipped as package data
`gradlog.schemas`."""
