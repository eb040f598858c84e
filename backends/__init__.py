"""normspec.backends: the built-in backends, registered through the
``normspec.backends`` entry-point group exactly as third-party plugins are."""
