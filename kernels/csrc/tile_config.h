/* What ldtilecfg reads (palette 1: rows and bytes a row of each of the 8 tiles), for the AMX
 * kernels. Each keeps its configuration as a static constant of this type rather than stores
 * before ldtilecfg: GCC 12 dropped such stores as dead where the function was not inlined, and
 * ldtilecfg then faulted. */
#ifndef KVPARK_TILE_CONFIG_H
#define KVPARK_TILE_CONFIG_H

#include <stdint.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

#endif
