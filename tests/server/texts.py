"""Texts shared by the speculative-decoding test and its benchmark (a passage to copy)."""

LIGHTHOUSE = (
    "The old lighthouse stood at the edge of the harbour for more than two hundred years. "
    "Its keepers climbed one hundred and twelve steps every evening to light the lamp, and "
    "every morning they climbed them again to trim the wick and polish the great glass lens. "
    "Ships coming home in the fog listened for its bell and watched for its slow white flash, "
    "which turned once every ten seconds. When the harbour was rebuilt, engineers wanted to "
    "pull the tower down, but the fishermen of the town signed a letter asking that it be "
    "kept. Today the lamp is electric and nobody lives in the keeper's cottage, yet the light "
    "still turns every night, and children from the village school visit each spring to count "
    "the steps and look out over the grey water towards the islands.")
