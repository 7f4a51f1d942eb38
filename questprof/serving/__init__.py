"""Quest inside a serving loop: questprof's decode attention in transformers' continuous
batching (`paged_attention`), the loop that feeds it a request mix (`loop`), the mixes
(`mixes`) and the latency figures of what it served (`latency`). torch and transformers are
imported inside functions: the package loads without them."""
