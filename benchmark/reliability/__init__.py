"""Load and fault scripts for the serving stack (`python -m benchmark.reliability.load`,
`python -m benchmark.reliability.faults`); their short variants run in the test suite."""
