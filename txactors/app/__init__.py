"""The app layer: typed handlers (`TxApp`) and the worker process that runs them."""
