"""Speed and traffic of the sparse path against offload, dense and the baselines: `bench sparse`, `bench latency`,
`bench store`."""
