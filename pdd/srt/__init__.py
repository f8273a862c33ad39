"""Everything that touches SGLang internals lives in this package (SGLang 0.5.23 pinned).

An SGLang upgrade should only need changes here.
"""

# The SGLang release pdd is built against: the one definition in Python. setup.py and
# launch/setup.sh install it (tests/test_hooks.py checks that every `sglang==` pin agrees).
SGLANG_VERSION = "0.5.23"
