"""Driver side: code that runs in the Spark driver process only."""
