"""The lookup table's read side: the bytes' format (table_format.py), what engines read
(reader.py) and the compiled read (native.py, peek_kernel.c). The service writes it
(radixkv/service/table_writer.py); docs/architecture.md "The lookup table" has the whole."""
