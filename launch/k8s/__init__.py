"""Kubernetes manifests for a PDD deployment across two datacenters, from one spec."""
