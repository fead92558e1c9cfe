"""The shared core, imported by every shmkv process: the arena's bytes, the wire protocol,
the error tree, the settings, the counters' schema, the client a worker attaches with, and
the key derivations. Nothing here imports the supervisor, the llama side or the CLI."""
