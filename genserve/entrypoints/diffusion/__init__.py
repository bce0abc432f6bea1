"""What the image, video and realtime families share: request parameters (`params.py`) and the
steps of running one request on the diffusion client (`serving.py`)."""
