"""spindle's three services. Importing the package first fixes gRPC's I/O engine for the
process (shared/grpc_io.py), before any service module imports grpc."""

from shared.grpc_io import configure_grpc_io

configure_grpc_io()
