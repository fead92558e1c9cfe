"""The CPU budget every worker of a deployment shares (runs in each process that holds a
``Llama``): who evaluates on how many cores, and which waiting prefill goes first."""
