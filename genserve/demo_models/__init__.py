"""Trained demo models of the shapes world and everything that makes them. Diffusion
(`shapes-image`, `shapes-video`): the procedural world (`world`), the scorer (`scorer`), the
pipeline (`pipeline`), configs (`models`), training (`train`) and evaluation (`evaluate`).
Vision-language (`shapes-vl`): config and tokenizer (`vl_model`), samples (`vl_data`), training
(`vl_train`) and evaluation (`vl_evaluate`). Streaming video (`shapes-stream`): its endless world
(`stream_world`), model (`stream_model`), autoencoder (`stream_ae`), the frame that follows the
shape when served (`stream_follow`), training (`stream_train`) and evaluation
(`stream_evaluate`). Weights live in `weights/`."""
