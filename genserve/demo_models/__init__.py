"""Trained demo diffusion models (`shapes-image`, `shapes-video`) and everything that makes them:
the procedural world (`world`), the scorer (`scorer`), the pipeline (`pipeline`), configs
(`models`), training (`train`) and evaluation (`evaluate`). Weights live in `weights/`."""
