"""Draft methods: one sub-package per method (model, training core, later LightningModule and drafter)."""
