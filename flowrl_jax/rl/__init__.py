"""The train job's machinery: `plan` (check a config, build its pieces once), `programs` (the jitted programs of an
iteration, stateless), `state` (the `TrainState` the loop owns, the optimizer, placement), `policy`, `minibatch`,
`schema` (the train config's fields). docs/design.md draws the flow."""
