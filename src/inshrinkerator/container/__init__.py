"""The ``.ink`` container: format constants, a writer and a validating reader."""

from .format import FORMAT_VERSION, MAGIC, Header, Section, TensorRecord
from .reader import ContainerReader
from .writer import ContainerWriter

__all__ = ["FORMAT_VERSION", "MAGIC", "Header", "Section", "TensorRecord", "ContainerReader", "ContainerWriter"]
