"""The frontend: HTTP, validation, image decoding and mask strings; never touches the GPU."""
