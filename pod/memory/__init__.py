"""Memory: pages and the pool, the prefix cache, the host store and tier under one budget,
copies in flight, slot files and the model identity that keys them."""
