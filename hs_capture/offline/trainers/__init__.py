"""Runtime patches that let a trainer read its offline data straight from a dump (`hscap train`)."""
