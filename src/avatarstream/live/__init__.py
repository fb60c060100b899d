"""Live sessions between the engine and the server: sessions, the chunk scheduler, capacity calibration, speech queue, idle motion."""
