"""Everything that touches SGLang internals lives in this package (SGLang 0.5.23 pinned).

An SGLang upgrade should only need changes here.
"""

SGLANG_VERSION = "0.5.23"
