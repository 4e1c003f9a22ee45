"""The shared training core of train.py and train_xla.py: config, data, optimisers and schedule,
checkpoints, monitoring, the loop, and the device backends."""
