"""Training components shared by every method's LightningModule (schedules, optimiser wiring)."""
