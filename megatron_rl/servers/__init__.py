"""Services megatron-rl runs as separate processes, reached over HTTP (the DARLING pair
classifier: `megatron-rl serve-classifier`, `megatron_rl.servers.classifier`)."""
