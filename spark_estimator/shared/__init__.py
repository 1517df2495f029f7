"""Code both sides use: the plain data the driver hands the tasks and the tasks hand back,
serialization, failure records, the value checks' counts, optional packages."""
