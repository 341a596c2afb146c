"""The Textual UI of `specchat run`: chats beside live speculation, throughput, memory and controls panels."""
