"""Flash storage: the on-flash format, the converter that writes it, the reader and the profiler."""
