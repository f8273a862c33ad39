"""pdd: cross-datacenter heterogeneous prefill-decode disaggregation for SGLang."""

__version__ = "0.1.0"
