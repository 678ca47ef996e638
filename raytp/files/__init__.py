"""Where training state lives outside a process: storage locations (fsspec: paths, shared filesystems,
s3://, gs://), safetensors read by byte range, the checkpoint format (written by the workers, read slice
by slice at any layout), Hugging Face directories, the one-device model file, and the sources a shard
takes its first state from."""
