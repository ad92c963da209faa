"""What the examples, the tests, the benchmarks and the service's default model build from: pipelines with random
weights (`zoo`), shipped with the package so that an installed copy serves without a source checkout."""
