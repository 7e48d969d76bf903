"""Vision-language inputs: images from requests (media) and their preprocessing for the engine (processor)."""
