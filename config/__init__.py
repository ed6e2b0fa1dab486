"""The ground floor: what every process needs before anything else, and imports no other
project package: settings, topic names, logging, and fetching jars."""
