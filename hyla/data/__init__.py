"""Datasets shared by several rooms: ``sharegpt`` (the ShareGPT conversations that `hyla bench`,
`hyla sim` and the default model's training script all read)."""
