"""Models usable without a model hub: a tiny random model for tests, SmolLM2-135M for the demo."""
